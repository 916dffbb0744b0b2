"""FedDRA (`fedheads feddra`, `fedheads.feddra`; the package is named `alignment`, vision-language
alignment, so that the API function is never shadowed by it): the algorithm, its dual encoder, paired image-text clients, DRO
weights, the VL backbones, the round driver, evaluation, probes, reports and the run writer."""
