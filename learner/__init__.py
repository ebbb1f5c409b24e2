"""Samples → PPO-clipped LoRA updates → versioned adapters hot-swapped into the engine."""
