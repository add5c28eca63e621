"""The ReCo RL loop: rollouts -> rewards -> advantages -> Megatron update -> weight sync."""
