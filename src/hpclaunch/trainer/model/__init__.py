"""The MMDiT itself: the network, its attention, the objective, the EMA and weights from another run."""
