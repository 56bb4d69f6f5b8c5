"""minisgl gateway: OpenAI-compatible HTTP and the public minisgl.v1.Generation gRPC API."""
