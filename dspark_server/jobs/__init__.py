"""Offline jobs that drive the native engine: SPS profiling, STS calibration, acceptance evaluation."""
