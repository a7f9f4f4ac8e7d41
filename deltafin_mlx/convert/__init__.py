"""deltafin-convert: rewrite a Hugging Face MoE checkpoint into Deltafin format."""
