"""Evaluation: speed and memory benchmarks (and, as they land, the perplexity harness and plots)."""
