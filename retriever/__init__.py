"""ragkv.retriever."""
