"""Framework integrations: ``ragkv.integrations.llamaindex`` and ``ragkv.integrations.langchain``.

Each is a module of its own, installed with an extra (``pip install 'ragkv[llamaindex]'`` or
``'ragkv[langchain]'``); importing this package imports neither framework.
"""
