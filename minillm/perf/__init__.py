"""Measuring: ``hardware`` (specs, measured peaks), ``roofline`` (cost model), ``metrics``, ``simulate`` (virtual
clock), ``workloads`` (traces), ``bench/`` (decode, serving, attention benchmarks)."""
