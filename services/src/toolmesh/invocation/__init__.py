"""The invocation service: checks a call, runs it through the bridge under its deadline, keeps the ledger."""
