"""``edge-client serve``: an OpenAI-compatible HTTP API on the device, and a keyboard demo.

- ``requests``: parsing and validating the OpenAI request bodies (errors in OpenAI's shape);
- ``openai_api``: the Starlette app with /v1/models, /v1/completions, /v1/chat/completions;
- ``keyboard``: the demo page at / and its WebSocket onto the editing-session API;
- ``runner``: the command (binding rules, uvicorn) and an in-thread server for tests.

Needs the ``serve`` extra (Starlette, uvicorn); the device runtime stays torch-free.
"""
