"""The types every layer shares and none owns: a request (Req and its sampling state), why it
finished, one forward's batch (ForwardBatch, ForwardMode) and the pool contract. The lowest layer:
it imports nothing of sparkserve but sampling_params."""
