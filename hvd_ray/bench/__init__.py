"""Measurement: the prompts, the interleaved loop, the methods and peers, the report modes the
benchmark jobs run, and client-side load generation and fault injection for the serving tests."""
