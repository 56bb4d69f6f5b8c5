"""The gateway's public APIs: OpenAI-compatible HTTP and the `minisgl.v1.Generation` gRPC service,
over one request path that both share:

    parse        http_app.py + json_body.py + openai_schema.py  |  grpc_service.py + grpc_schema.py
    build job    job.py (the Job, its checks), tool_choice.py (tools -> parsers and grammar),
                 structured.py (response_format and extension fields -> grammar)
    run          generation.py: check, tokenize, route and submit (upstream/), stream the
                 detokenized step events back as choice chunks
    format       choice_output.py (echo; reasoning / content / tool calls through agent/), then
                 openai_format.py (JSON, SSE)  |  grpc_format.py (Choice messages)

The served model's output formats (tool-call and reasoning syntax) come from the gateway
(`Gateway.info.formats`) and travel on each chat job. Other modules: http_limits.py (bounds on
the HTTP request head), token_routes.py (/tokenize, /detokenize).
"""
