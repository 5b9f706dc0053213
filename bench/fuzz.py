"""`python -m bench.fuzz --minutes N`: the fuzzer of tests/support/fuzzing.py, for minutes, against
the services as processes (see that module)."""

from fuzzing import main

if __name__ == "__main__":
    main()
