"""Throwaway Postfix instances and a sink SMTP server, for tests, the demo and benchmarks."""
