"""Evaluation as the paper measures it: pure scoring functions with explicit arguments
(GPT windows, WikiText, LAMBADA, BERT's MLM/SOP and fine-tuned accuracy)."""
