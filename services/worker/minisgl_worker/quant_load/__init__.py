"""Loading pre-quantized checkpoints beyond fp8 (loading layer): each format's parameters, the
loaders that repack the publisher's tensors into the layouts of quant/, and the swap of a layer's
compute onto them."""
