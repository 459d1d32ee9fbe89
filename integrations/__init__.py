"""ragkv.integrations."""
