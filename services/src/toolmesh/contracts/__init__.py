"""What the invocation service and the bridge share: the ledger of invocations and the route records."""
