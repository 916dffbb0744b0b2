"""FedDRA (`fedheads feddra`): the algorithm, its dual encoder, paired image-text clients, DRO
weights, the VL backbones, the round driver, evaluation, probes, reports and the run writer."""
