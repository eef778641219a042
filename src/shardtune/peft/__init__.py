"""Parameter-efficient fine-tuning helpers: 4-bit NF4 base weights (QLoRA) and 8-bit AdamW."""
