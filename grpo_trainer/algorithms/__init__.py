"""Pure tensor math: advantage estimators, policy losses, completion log-probs. Imports nothing else of this package."""
