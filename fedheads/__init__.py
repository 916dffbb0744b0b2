"""fedheads: federated heads (FedPCL, FedNCM, LP, MLP and the papers' baselines) trained
directly on cached frozen-backbone features, with a vectorised engine."""

__version__ = "0.1.0"
