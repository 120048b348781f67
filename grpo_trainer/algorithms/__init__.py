"""Pure tensor math: advantage estimators, losses and surrogates, masks, entropy control, zero-variance groups,
truncated supports, mismatch statistics. Imports nothing else of this package."""
