"""The batch every drafter trains on: what the training loop hands a drafter kind.

B rows of T tokens each (``data.row_tokens``), target hidden size H; rows hold whole samples
("documents") back to back, then padding (``draftsmith.train.packing`` builds them):

- ``input_ids`` long [B, T]: token ids; 0 on padding.
- ``aux_states`` [B, T, n_aux * H]: the tapped layers that feed the head (``aux_layer_ids``,
  by default every tapped layer but the last), concatenated in ascending layer-id order.
- ``teacher_states`` [B, T, H]: layer id N = the target's ``num_hidden_layers``, i.e. its
  last layer's output before the final norm; row p is the state that predicts x_{p+1}.
- ``position_ids`` long [B, T]: 0, 1, ... restarting at every document (and at the padding).
- ``doc_ids`` long [B, T]: 0, 1, ... for the documents of a row; ``PAD_DOC_ID`` (-1) on
  padding, so that padding never attends to, or is attended by, a real token
  (``ttt.document_causal_mask``) and no shifted token or label crosses into it.
- ``loss_mask`` bool [B, T]: true on assistant tokens; false on padding.
"""

from __future__ import annotations

from torch import Tensor

PAD_DOC_ID = -1

Batch = dict[str, Tensor]
