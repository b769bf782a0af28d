"""Head files in and out: what every exported head directory shares (``directory``: config,
safetensors, model card, one-line errors) and what reading a published one shares
(``read``), whatever the kind."""
