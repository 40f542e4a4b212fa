"""Generation: the engine (static batches and decode slots), the KV cache's bytes, and the
resharding of a trained model into the inference model's layout."""
