"""One module per model family, each declaring `FAMILY` (models.family.Family)."""
