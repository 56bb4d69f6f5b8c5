"""minisgl: launcher, shell and the in-process LLM class."""
