"""The target model: its folder read without torch (folder), and loaded for a forward (model)."""
