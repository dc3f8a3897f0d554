"""megajax: Megatron-LM tensor parallelism in JAX and Flax NNX."""
from megajax.config import Config, ConfigError, ModelConfig, TrainConfig, load_config
from megajax.mesh import make_mesh
from megajax.model import GPT, abstract_model, init_model, param_specs

__all__ = ["Config", "ConfigError", "GPT", "ModelConfig", "TrainConfig", "abstract_model",
           "init_model", "load_config", "make_mesh", "param_specs"]
