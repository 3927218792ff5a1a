"""What rides on the engine's step besides plain requests: searches, the scorers and the rewards
route, the judge's questions, speculation's slots; one owner (`runtime.steps.work.StepWork`)."""
