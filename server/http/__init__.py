"""The OpenAI-compatible HTTP API of the gateway: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` (``app.py``), on uvicorn in the
gateway's loop (``server.py``). Bodies become the same service dataclasses as gRPC messages
(``schema.py``) and go down the same ``GenerationService`` path; responses and errors take
OpenAI's shapes (``responses.py``, ``errors.py``)."""
