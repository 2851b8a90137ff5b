"""From logits to tokens: sampling parameters, the sampler and its slots, batched maths, logprobs, grammars."""
