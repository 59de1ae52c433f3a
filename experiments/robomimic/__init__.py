"""Image-based robot policy learning on robomimic (section "Image-Based Robot Policy Learning")."""
