"""Shared state behind one interface: tools, ledger records and routes, in memory or on Redis."""
