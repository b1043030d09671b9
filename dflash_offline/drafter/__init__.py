"""The DFlash drafter: the model, its attention mask, and the serving export format."""
