"""Framework integrations: ``ragkv.integrations.llamaindex``, ``.langchain`` and ``.vllm`` (a KV connector).

Each is a module of its own, installed with an extra (``pip install 'ragkv[llamaindex]'``,
``'ragkv[langchain]'``; vLLM in a venv of its own, see docs/vllm.md); importing this package imports
no framework.
"""
