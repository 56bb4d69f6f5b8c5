"""Weight formats of pre-quantized checkpoints beyond fp8 (foundation layer: tensors and reference
formulas only, no layers): W4A16 (AWQ, GPTQ, compressed-tensors pack-quantized), MXFP4, INT8."""
