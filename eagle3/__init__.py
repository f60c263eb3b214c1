"""eagle3: train EAGLE-3 draft heads for speculative decoding."""
__version__ = "0.1.0"
