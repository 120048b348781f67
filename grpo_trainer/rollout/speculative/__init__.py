"""Speculative rollouts drafted from the group: fewer decoder forwards for the same completions.

A group is G completions of one prompt; once a policy has learnt anything, siblings share long spans. Each decoder
forward here feeds a row's last token and a point-mass draft of the next ones (`drafts`: the siblings' tokens, the
same prompt's earlier completions, the prompt itself), and commits every drafted token the sampler would have drawn
anyway (`verify`), so one forward commits several tokens. `policy` chooses how many to draft; `loop` runs it over
the fast decoder (`rollout.fast.decoder.Decoder.verify`); `settings` holds the options.
"""
