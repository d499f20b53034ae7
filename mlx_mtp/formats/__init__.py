"""What Gemma 4 reads and writes besides token ids: chats rendered with the model's template
and its output parsed (chat.py; request text kept apart from the template's markup, markup.py;
the tool-call syntax, toolcall.py), images made into patches (images.py) and the image path of a
checkpoint (vision.py), audio decoded into log-mel features or the 12B's frames (audio.py), video
decoded and its frames sampled (video.py), and a request's media placed in its prompt (media.py)."""
