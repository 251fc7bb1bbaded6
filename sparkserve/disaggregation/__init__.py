"""Prefill/decode disaggregation's transport: how a request's prompt state (every pool component's
rows, mem/transfer.py) and its first-token result move from a prefill server to the decode server
that reserved room for it. The scheduler side (scheduler/disaggregated.py) decides when."""
