"""Batch prediction from a trained run (`fedheads predict`): the classifier per client (predict), faiss
prototype banks (prototypes) and the features of new images (inputs, the only part touching images)."""
