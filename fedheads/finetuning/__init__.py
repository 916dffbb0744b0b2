"""Live fine-tuning (FedNCM paper's stage 2, "FineTune"): everything in fedheads that touches
images or trainable backbones during training. It is the only part of fedheads that imports
`embedcache.backbones` / `embedcache.sources` (and through them torchvision and timm); the head
path (`fedheads train/compare/predict`) imports none of them.

    fedheads.finetuning.model    the network trained live: frozen prefix -> trainable stages -> head
    fedheads.finetuning.data     client batches from live images or from cached maps/features
    fedheads.finetuning.algorithm the FT algorithm (typed state, pure client/server functions, sums)
    fedheads.finetuning.heads    stage 1 (FedNCM / LP / random head) on the feature store
    fedheads.finetuning.rounds   the live round loop (FT and FedDRA): records, timing, eval cadence, checkpoints, resume
    fedheads.finetuning.driver   fine-tuning's round: one model on the device, clients added to running sums
    fedheads.finetuning.runner   `fedheads finetune`: run directories, accounting, Figure-1 plots
"""
