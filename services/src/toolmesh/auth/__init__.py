"""Who may do what: tokens, the grants they carry, and the per-RPC policy."""
