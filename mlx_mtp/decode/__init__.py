"""The driver and the speculative round: `BatchGenerator` (batch.py) steps every running
sequence through draft -> verify -> accept -> advance (speculative.py), with prompts
prefilled in chunks (prefill.py), proposers (drafters.py), sampling and logits processors,
structured output, statistics, detokenized text and the one-sequence `generate`."""
