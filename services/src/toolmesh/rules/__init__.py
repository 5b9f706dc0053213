"""The rules every service applies: the limits an operator sets and the cost bound on schemas."""
