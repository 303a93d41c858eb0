"""qstrat: pluggable quantization strategies for refitting vLLM from an RL trainer."""
