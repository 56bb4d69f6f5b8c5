"""minisgl gateway: OpenAI-compatible HTTP and the public minisgl.v1.Generation gRPC API.

Three rooms: api/ (both public APIs over one request path), agent/ (the output parsers, one file
per syntax) and upstream/ (the engines: discovery, routing, scheduler links, streams). The modules
here are the process itself: config, server, the shared gateway state, errors, request context
and metrics."""
