"""The model on its device: model runner, persistent batch, CUDA graphs, compilation, staging, readback, attention."""
