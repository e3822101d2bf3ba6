"""Benchmarks of async_ckpt against stock DeepSpeed, DCP async_save and the hardware floors."""
