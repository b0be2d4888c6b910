"""EAGLE-3 drafter training: the data (``data``: the target's features and answers from the
rollout engine), the training-time-test loss (``ttt``) and the training loop (``train``)."""
