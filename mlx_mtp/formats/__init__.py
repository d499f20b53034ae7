"""What Gemma 4 reads and writes besides token ids: chats rendered with the model's template
and its output parsed (chat.py), images made into patches (images.py), and images in
requests with the vision encoder that makes them soft tokens (vision.py)."""
